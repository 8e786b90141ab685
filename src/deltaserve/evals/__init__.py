"""`deltaserve eval`: held-out curriculum tasks through the offline engine or a server, scored per
task (`score`), with options that push requests through one engine path (`runner`)."""
