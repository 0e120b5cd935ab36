"""Test helpers: GCS emulator, fault-injecting proxy, multi-process launcher.

Library code never imports this package.
"""
