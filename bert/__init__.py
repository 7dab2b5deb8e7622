"""MLPerf Training BERT phase-2 harness: unpadded BERT, load balancing, bucket-wise clipping."""
