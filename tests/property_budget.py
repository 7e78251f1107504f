"""How many examples each property test tries, by Hypothesis profile.

Each property test states its own budget, ``@settings(max_examples=examples(30))``:
what a CI run can afford. The profile (``HYPOTHESIS_PROFILE``, registered in
``tests/conftest.py``) decides how it is spent:

- ``default`` (a local run): the stated budget, new random inputs on every run; a
  failing input is kept in ``.hypothesis/`` and tried first next time.
- ``ci`` (set by ``.ci/run``): the stated budget, derandomized: every CI run checks the
  same inputs, so a red CI is reproducible and never a lucky draw.
- ``explore``: ``EXPLORE_FACTOR`` times the stated budget, random. Run it before
  changing a strategy, the secure-aggregation kernel or the codec, e.g.
  ``HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest -q tests/strategies``
  (the fuzz suites also read ``FEDLOOM_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import os

EXPLORE_FACTOR = 20
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")


def examples(budget: int) -> int:
    """A property test's number of examples under the active profile."""
    return budget * EXPLORE_FACTOR if PROFILE == "explore" else budget
