"""lorarl: clients."""
