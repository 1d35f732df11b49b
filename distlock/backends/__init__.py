"""Lock backends: one module per server type, each implementing ``base.BaseLockBackend``."""
