"""A decode step's input projection with its input computed inside: the AttnRes mix and RMSNorm."""
