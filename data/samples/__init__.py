"""The shipped sample datasets (small slices of each benchmark) and the script that made them."""
