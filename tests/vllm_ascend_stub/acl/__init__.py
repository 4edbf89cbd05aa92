"""A STAND-IN for ``acl`` (CANN's pyACL) on vllm-ascend's weight-loading path. It
is not pyACL and reaches no device.

vllm-ascend's worker module imports its device allocator, which imports
``acl.rt.memcpy`` at module level (sleep mode only). Exactly that name is here;
calling it raises :class:`StandInError`.
"""

from . import rt  # noqa: F401


class StandInError(RuntimeError):
    """A pyACL function was called on the loading path."""
