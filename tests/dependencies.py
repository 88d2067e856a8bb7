"""How a test reports a missing optional dependency: a skip on a developer's machine, a
failure where the environment promises it. CI promises Redis (RAGKV_REQUIRE_REDIS=1) and the
real model (RAGKV_REQUIRE_REAL_MODEL=1), so a failed install there turns red instead of
quietly skipping the tests that need them."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(what: str, install: str, promise: str, module_level: bool = False) -> NoReturn:
    """Skip (or, with the environment variable `promise` set to 1, fail) because `what` is not
    installed; `install` says how to install it."""
    if os.environ.get(promise) == "1":
        pytest.fail(f"{what} is not installed and {promise}=1 ({install})", pytrace=False)
    pytest.skip(f"{what} is not installed ({install})", allow_module_level=module_level)


def require_redis_package() -> None:
    """The `redis` client package, which the Redis tier of the chunk store needs."""
    try:
        import redis  # noqa: F401
    except ImportError:
        missing("the redis package", "pip install -e '.[test]'", "RAGKV_REQUIRE_REDIS")
