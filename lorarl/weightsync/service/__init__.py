"""The weight-sync service (`lorarl serve weightsync`): servicer, core and the parts it wires together."""
