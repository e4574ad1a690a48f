"""lorarl: services/trainer."""
