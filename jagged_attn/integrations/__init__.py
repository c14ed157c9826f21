"""Adapters to other libraries; each module imports its library and is imported only when used."""
