"""Search: from a budget to a verified plan (anchors, calibration, rounds, mixes, refinement)."""
