"""The plan tests compile for topologies this host does not have; the suite's persistent cache could not load those
programs back (``k3jax.plan.topology.not_cached``), so these modules write none."""

import pytest

from k3jax.plan.topology import not_cached


@pytest.fixture(autouse=True, scope="module")
def _topology_programs_not_cached():
    with not_cached():
        yield
