"""Datasets: the loaders, converters, the dataset registry and the shipped samples."""
