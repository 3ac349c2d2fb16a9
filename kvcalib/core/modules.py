"""Job packages that can be called: `kvcalib.calibrate(...)` runs the job while `kvcalib.calibrate` stays the
package (`from kvcalib.calibrate import CalibrateOptions`, `import kvcalib.calibrate.pipeline as p` work as ever).

The API's names are the jobs' names, and a package's attribute for a subpackage is the subpackage once it is
imported (the import system sets it), so the subpackage itself is made callable instead of shadowing it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["callable_package"]


def callable_package(name: str, function: Callable[..., Any]) -> None:
    """Make the module `name` (a package's __init__, running) call `function` when called."""
    module = sys.modules[name]

    class CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        __call__.__doc__ = function.__doc__

    CallablePackage.__name__ = CallablePackage.__qualname__ = f"CallablePackage[{name}]"
    module.__class__ = CallablePackage
