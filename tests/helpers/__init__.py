"""Helpers the tests share, one concept a module: test modules and conftests import them."""
