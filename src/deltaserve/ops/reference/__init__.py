"""Slow, obviously-correct oracles for every fast op: token loops, explicit masks, per-expert
loops, float64-friendly (they compute in the dtype they are given). Tests compare against them;
nothing in the serving path imports them."""
