"""pipedsl.visualize"""
