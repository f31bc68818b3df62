"""What ``compat.probe()`` must report, one row per vLLM release in the tox matrix.

The rows live in ``compat/proven.py`` (``PROVEN``), because the product answers from them too
(``python -m compat --check``: is this release proven?). Every row was produced by running the
real release in its tox env (``tools/add-release VER``, or by hand
``tools/tox -e vllmVER -- tests/matrix --record-expected -s``), and ``tests/matrix/test_compat_probe.py``
checks it in that env against facts read from the release's own code without compat. This module
keeps the names the tests use.
"""

from compat.proven import PROBED, PROVEN as EXPECTED, release, row

__all__ = ["EXPECTED", "PROBED", "release", "row"]
