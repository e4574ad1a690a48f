"""lorarl: services."""
