"""Python code generated from proto/ (`make proto`); do not edit."""
