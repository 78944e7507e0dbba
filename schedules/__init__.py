"""The built-in schedules: one `.pipe` file each (package data, no code)."""
