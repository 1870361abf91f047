"""What the tests share: helpers they import, and scripts they run in subprocesses."""
