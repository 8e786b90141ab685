"""What a request is, before any step runs it: sampling parameters, the sequence's state, its
outputs, structured-output grammars and reasoning budgets, the detokenizer, image inputs and the
checks a request passes on arrival. The lowest room of the engine: imports no other room."""
