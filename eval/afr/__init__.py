"""Answer-flip protocol (Who Flips?): coercion, blind/self/cross challenges, AFR metrics, MaxFlip."""
