"""lorarl: services/weightsync."""
