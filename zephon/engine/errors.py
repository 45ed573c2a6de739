"""The errors the engine's parts raise to one another (and, for a lost cluster, to the user): one home."""

from __future__ import annotations

from ..errors import SourceError


class HostInterrupted(RuntimeError):
    """A step awaited from lane workers was given up (a host's ``interrupt()``): the steps-ahead thread is being
    stopped, and the host is rewound, reset or closed before the next step."""


class ResumeMismatch(SourceError):
    """A lane position that does not fall where the data says records are: changed data, or an edited state."""


class RayClusterLost(RuntimeError):
    """The Ray cluster's head stopped answering for longer than ``RayOptions.lost_after_s``."""
