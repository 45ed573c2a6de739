"""Checkpoints: lane states, loader states, fingerprints, merging and validation, in one package.

- :mod:`zephon.state.lane`: a lane's resumable state and the checks of each field;
- :mod:`zephon.state.checkpoint`: the loader state (lane-keyed, versioned, fingerprinted, digested),
  merging the ranks' states, saving and loading.

The fingerprint itself is computed from the compiled pipeline (:mod:`zephon.graph.fingerprint`).
"""

from .checkpoint import (STATE_FORMAT, STATE_VERSION, check_compatible, check_container, load_state, merge_states,
                         save_state, seal, state_digest)
from .lane import LaneState, parse_lane_state
from ..errors import StateError

__all__ = ["LaneState", "STATE_FORMAT", "STATE_VERSION", "StateError", "check_compatible", "check_container",
           "load_state", "merge_states", "parse_lane_state", "save_state", "seal", "state_digest"]
