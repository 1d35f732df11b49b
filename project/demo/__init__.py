"""The demo app: a management command that shows distlock at work."""
