"""What klbench prints: messages, where results are, the progress bar."""
