"""pipedsl.runtime"""
