"""Greedy decoding's output head: each row's argmax over the vocabulary without storing the logits."""
