"""Python references the C library is compared with (test oracles, not product code)."""
