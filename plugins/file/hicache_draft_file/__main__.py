from hicache_draft_file.cli import file_group

file_group()
