"""What the test modules share: paths, rank spawning, tiny runs, checkpoints, servers.

Test modules import from here (or take a fixture from a conftest.py), never from each other."""
