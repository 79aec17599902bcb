"""From logits to tokens: processing tables, grammar masks, coins, sampling, logprobs."""
