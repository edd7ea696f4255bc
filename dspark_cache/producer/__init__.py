"""``dspark-produce``: chat rows -> target forward -> compact WebDataset shards."""
