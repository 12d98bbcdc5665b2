"""qspec"""
