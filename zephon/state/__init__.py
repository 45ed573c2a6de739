"""Checkpoints: lane states, loader states, fingerprints, merging and validation (one package).

A loader state is ``{"format", "version", "fingerprint", "pipeline", "step", "lanes": {lane: LaneState},
"digest"}``. Because it is keyed by lane, the states of all ranks of a checkpoint merge into one from
which any rank of any world size dividing the lane count can resume.
"""

from .loader import (STATE_FORMAT, STATE_VERSION, StateError, check_compatible, fingerprint, load_state,
                     merge_states, recipe_summary, save_state)

__all__ = ["STATE_FORMAT", "STATE_VERSION", "StateError", "check_compatible", "fingerprint", "load_state",
           "merge_states", "recipe_summary", "save_state"]
