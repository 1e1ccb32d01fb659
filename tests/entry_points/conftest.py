"""The v1.1.5 script tests' directory (tests/helpers/v1_scripts.py), built once per test file."""

import pytest

from tests.helpers.v1_scripts import make_workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory)
