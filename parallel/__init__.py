"""pipedsl.parallel"""
