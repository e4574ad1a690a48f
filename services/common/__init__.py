"""lorarl: services/common."""
