"""Drafters: everything that proposes token trees for a stage above it."""
