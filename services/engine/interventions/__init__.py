"""Interventions: steering, monitors, patching and capture at hook sites of the residual stream."""
