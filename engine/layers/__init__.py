"""Building blocks of the Llama family: norms, rotary embeddings, fused linears, paged attention."""
