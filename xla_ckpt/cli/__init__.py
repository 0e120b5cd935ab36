"""See DESIGN layers."""
