"""``dspark-monitor s3://...``: a cache on object storage followed into a local directory the monitor reads."""
