"""Every ``ASCEND_FA_*`` environment variable (re-exported from
:mod:`ascend_fa.atb_ops.settings`, which holds the declarations: the lowest layer,
so that the ops, the backends and the product all read through one module).

``python -m ascend_fa.settings`` prints each variable's value here;
``--markdown`` prints the reference page ``docs/reference/environment.md``.
"""

from __future__ import annotations

from ascend_fa.atb_ops.settings import (
    SETTINGS,
    Setting,
    SettingError,
    get,
    is_set,
    lookup,
    main,
    markdown,
    raw,
)

__all__ = [
    "SETTINGS",
    "Setting",
    "SettingError",
    "get",
    "is_set",
    "lookup",
    "main",
    "markdown",
    "raw",
]

if __name__ == "__main__":
    raise SystemExit(main())
