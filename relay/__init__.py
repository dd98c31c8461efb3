"""Relays for members behind NAT: the protocol, the books, the service and both ends of a circuit."""
