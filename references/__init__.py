"""float64 references: the math of DESIGN.md, written for clarity, never for speed."""
