"""Resilience: the checks before any work, torchft's fault tolerance and the straggler detector;
what keeps a run going or says why it stopped, apart from the loop itself."""
