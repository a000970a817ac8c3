"""Test and benchmark scaffolding: tiny checkpoints in the released layout
(`synthetic`) and drafters with known behaviour (`drafters`)."""
