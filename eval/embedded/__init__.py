"""The embedded models: the tiny model (flipguard:tiny) and the organism (flipguard:organism),
each built once and cached, served by name through the flipguard.models entry points."""
