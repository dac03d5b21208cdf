"""StarSD: the two-device star, one draft service for N targets, the draft's file format and switches, the protocol's
overhead, and what cores-as-devices costs."""
