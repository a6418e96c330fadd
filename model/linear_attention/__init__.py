"""Linear-attention sequence mixers: recurrent state per request instead of paged K/V."""
