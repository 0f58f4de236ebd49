"""Data types and interfaces only: nothing here imports torch or starts anything."""
